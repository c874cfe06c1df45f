"""The benchmarks: each module prints its tables (figures in docs/benchmarks.md) and is run from
the repository root as ``python -m bench.<name>``, with ``--help`` for its options.

Speed: ``throughput`` (service + client vs DataLoader vs the raw decode limit), ``transport``
(the data path with decoding off vs raw pyzmq), ``photos`` (real photos; build the sets with
``photo_sets``), ``pipelines`` (user pipelines), ``replicas``, ``curve`` and ``cipher`` (CURVE's
cost), ``rest`` (REST latency under load), ``gpu`` (H2D and data stall; ``gpu_session.sh`` runs it
on a GPU machine), ``index_memory``, ``profile_decode``. Reliability figures:
:mod:`bench.reliability` (``chaos``, ``freeze``, ``hostile_figures``).

What the scripts share lives in :mod:`bench.harness` (service launching, timing, medians, tables,
CPU pinning); :mod:`bench.plots` draws the figures; :mod:`bench.doubles` holds the ``blank``
pipeline the transport benchmark registers (decoding off, with no hook in the product);
:mod:`bench.models` is the GPU benchmark's network.
A service in its own process comes from :mod:`testkit.service`, the same helper the tests use.
"""
