"""The dispatcher: the service's one thread of state, as an I/O shell (:mod:`.loop`) around one
:class:`~.state.DispatchState`, which changes only through ``handle(event, now) -> commands``.

Modules: ``loop`` (the shell: sockets, poll, the pool's processes) with ``mailbox`` (calls from
other threads); ``state`` (the one door: sessions, streams, memory, tasks, scheduler) and
``events`` (what goes in and out of it); ``door`` (a client's asks checked against its stream);
``admission`` (Hello -> open / refuse) with ``jobs`` (the job rules); ``memory`` (batch slots,
reserves, lending, waiting); ``streams`` (the Opening and Stream records); ``stream_state`` (one
stream's progress); ``sending`` (the BatchLayout, a batch's message and frames); ``tasks`` (tasks
on workers) with ``deadlines``; ``scheduler``; ``sessions``; ``flood`` (what a connection may
send: its allowance, and the cut past it); ``status`` (the snapshot, and the
one Totals type); ``curve`` (CURVE keys on the data port); ``heap`` (freed heap given back after
a flood); ``lanes`` (bulk lanes: the lane port's listener and each client's lane senders, owned
by the loop).

Glossary (one meaning each, in code and messages):

job
    One training, named by its loaders (``Hello.job``); its ranks must agree on the JobSpec.
rank
    One process of a job's training, and its share of each epoch (``Hello.rank``).
client
    One loader instance (``RemoteLoader``), named by ``Hello.client``; it may hold several
    connections (its epoch lookahead is a second one) and counts as one client in the status.
ident
    A connection's ROUTER identity (bytes): what the dispatcher addresses messages to.
session
    What the dispatcher knows of one ident: its fd, its client, job and rank, its stream.
stream
    One connection's pass over one rank's epoch (``Hello.stream``): the batches its client
    asked for (``Hello.batches``, then ``Request``), sent in the order asked, from one segment of
    ``Hello.slots`` slots. There is one kind of stream (protocol 6).
life
    Where a stream is (``door.Life``): waiting, running, caught up, quiet, lent, starved,
    ending, ended.
task
    One piece of work a worker does: a whole batch, or one sample of a batch being isolated.
slot
    Room for one batch in a segment; a worker writes into it, the send reads from it (a
    co-located client *borrows* it until its Release).
made
    A batch a worker finished whose send waits for the batches before it (``StreamState.made``).
window
    The most batches a stream may have asked and not yet been sent (``Hello.window``): the
    client's ordering window, ``prefetch x replicas`` (``shuffle_window`` is the plan's).
prefetch
    Fetching ahead of use: the batches a client asks ahead (``RemoteLoader(prefetch=)``), the
    shards a remote source downloads ahead (``--shard-prefetch``). Never a count of slots.
ready
    A worker said Ready: the service can serve (``/readyz``). A stream with work to do is
    *offered* to the scheduler (``Scheduler.offer``).
event, command
    What goes into ``DispatchState.handle`` and what comes out (``events.py``); a stream's
    own outputs (send a batch, finish, fail) are its *effects*.
segment
    One named shared-memory region (``shm.Segment``) holding a stream's slots, or kept as its
    ident's reserve for the next stream.
replica
    One loader service among several that serve the same data to a client.
lane
    A plain TCP connection beside an ident's ZeroMQ one (``--lane-port``, ``RemoteLoader(lanes=N)``)
    that carries a stripe of each of its batches' outputs; an ident's lanes are its *lane set*.
allowance, cut
    What one connection may still send beyond what it was sent (``flood.py``, in units of a
    message or 4 KiB); a connection past it is *cut*: its socket shut down, its session dropped,
    what its ident sends for a while dropped unread.
lookahead
    A client's next epoch started early, on a second connection: served only when no current
    epoch can use a worker, and given slots only if a current epoch keeps room.
"""
