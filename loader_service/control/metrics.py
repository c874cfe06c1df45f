"""Prometheus metrics, read from one dispatcher status snapshot per scrape (so a scrape
never sees half-updated counters and the data path pays nothing for metrics)."""

from __future__ import annotations

from typing import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class StatusCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        t = s["totals"]
        for name, key, doc in (
            ("loader_samples", "samples", "Samples delivered to clients."),
            ("loader_batches", "batches", "Batches delivered to clients."),
            ("loader_bytes", "bytes", "Image bytes delivered to clients."),
            ("loader_skipped_samples", "skipped", "Samples skipped by the on_error=skip policy."),
            ("loader_bad_messages", "bad_messages", "Malformed or refused client messages."),
            ("loader_refused_asks", "refused_asks",
             "Requests refused at the door (outside the plan, repeated, past the window)."),
            ("loader_internal_errors", "internal_errors",
             "Bugs met while acting for one client; that client was failed, the service kept serving."),
            ("loader_failed_tasks", "failed_tasks", "Decode tasks that failed (on_error=raise)."),
            ("loader_redone_tasks", "redone_tasks", "Tasks redone after their worker died."),
            ("loader_streams", "streams", "Client streams (rank-epochs) started."),
            ("loader_floods_cut", "floods_cut",
             "Data-port connections cut for sending past their allowance (--client-allowance)."),
            ("loader_silent_connections_cut", "silent_cut",
             "Data-port connections cut for bringing nothing (not even a ZMTP PING) for 3 of their client's heartbeats."),
            ("loader_unread_connections_cut", "unread_cut",
             "Data-port connections cut for reading nothing of what waited for them for 3 of their client's heartbeats."),
            ("loader_streams_held_back", "held_back",
             "New streams that waited for their client to read what its earlier streams were sent."),
            ("loader_denied_addresses", "denied_addresses",
             "Peer addresses refused new data-port connections for their stranded ones (--max-stranded-per-address)."),
            ("loader_flooded_messages", "flooded_messages",
             "Client messages dropped unread: past a connection's allowance, or from one cut lately."),
            ("loader_refused_handshakes", "refused_handshakes",
             "Data-port handshakes refused (CURVE: unknown key, no keys, wrong server key)."),
        ):
            yield CounterMetricFamily(name, doc, value=t[key])
        w = s["workers"]
        yield GaugeMetricFamily("loader_workers_target", "Target worker count.", value=w["target"])
        g = GaugeMetricFamily("loader_workers", "Worker processes by state.", labels=["state"])
        for state in ("starting", "idle", "busy", "leaving", "stopping", "failed"):
            g.add_metric([state], w["counts"].get(state, 0))
        yield g
        yield CounterMetricFamily("loader_worker_deaths", "Workers that died unexpectedly.", value=w["deaths"])
        yield CounterMetricFamily("loader_worker_stop_kills", "Workers killed for not exiting in time after a stop.",
                                  value=w["stop_kills"])
        conns = GaugeMetricFamily("loader_connections", "Data-port connections (/v1/status connections): open, "
                                  "sessions, pending, waiting, stranded.", labels=["kind"])
        for kind, n in s.get("connections", {}).items():
            conns.add_metric([kind], n)
        yield conns
        stage = CounterMetricFamily("loader_stage_seconds", "Seconds spent per stage (workers and clients).",
                                    labels=["stage"])
        for k, v in s["stage_s"].items():
            stage.add_metric([k], v)
        yield stage
        yield GaugeMetricFamily("loader_clients", "Connected clients.", value=s["clients_total"])
        yield GaugeMetricFamily("loader_throughput_samples_per_second", "Recent delivery rate.",
                                value=s["throughput"]["samples_per_s"])
        yield GaugeMetricFamily("loader_shm_bytes", "Bytes of batch slots in shared memory.", value=s["shm_bytes"])
        ds = GaugeMetricFamily("loader_dataset_files_not_served",
                               "Files added to or removed from a dataset since the service scanned it (not "
                               "served until a restart).", labels=["dataset", "change"])
        for name, d in s["datasets"].items():
            c = d.get("changed_on_disk") or {}
            for change in ("added", "removed"):
                ds.add_metric([name, change], c.get(change, 0))
        yield ds
        yield from shard_cache_metrics(s.get("shard_cache", {}))
        a = s.get("autoscaler", {})
        if a.get("enabled"):
            d = CounterMetricFamily("loader_autoscaler_decisions", "Autoscaler decisions.", labels=["action"])
            for action, n in a["counts"].items():
                d.add_metric([action], n)
            yield d


def shard_cache_metrics(caches: dict):
    """Per dataset in object storage: its shard cache's bytes, hits, misses, downloads and waits
    (a dataset read straight from the store, a pack or loose images over the cap, has only its retries)."""
    if not caches:
        return
    for name, key, doc, family in (
        ("loader_shard_cache_bytes", "cached_bytes", "Bytes in the shard cache (complete and downloading).",
         GaugeMetricFamily),
        ("loader_shard_cache_max_bytes", "max_bytes", "The shard cache's cap (--cache-max-gb).", GaugeMetricFamily),
        ("loader_shard_cache_hits", "hits", "Shard opens served from the cache.", CounterMetricFamily),
        ("loader_shard_cache_misses", "misses", "Shard downloads started by a read.", CounterMetricFamily),
        ("loader_shard_cache_prefetches", "prefetches",
         "Shard downloads started ahead of the reads (--shard-prefetch).", CounterMetricFamily),
        ("loader_shard_cache_evictions", "evictions", "Shards evicted to stay under the cap.", CounterMetricFamily),
        ("loader_shard_cache_failures", "failures", "Shard downloads that failed.", CounterMetricFamily),
        ("loader_shard_cache_downloaded_bytes", "downloaded_bytes", "Bytes downloaded into the cache.",
         CounterMetricFamily),
        ("loader_shard_cache_download_seconds", "download_s", "Seconds spent downloading shards.",
         CounterMetricFamily),
        ("loader_remote_retries", "retries", "Requests to the object store retried after a transient failure "
         "(no answer, dropped connection, timeout, 5xx, 429), every process.", CounterMetricFamily),
        ("loader_shard_cache_wait_seconds", "wait_s",
         "Seconds reads waited for another process's download or for room.", CounterMetricFamily),
    ):
        m = family(name, doc, labels=["dataset"])
        for dataset, c in caches.items():
            if key in c:
                m.add_metric([dataset], c[key])
        yield m


def make_registry(snapshot: Callable[[], dict]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatusCollector(snapshot))
    return reg
