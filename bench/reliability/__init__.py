"""Reliability figures (docs/reliability.md), not speed: ``python -m bench.reliability.chaos``
(nothing lost or doubled while workers, clients and the service are killed), ``freeze`` (recovery
after the service is stopped and continued), ``hostile_figures`` (slowloris, scale storm, rogue peer)."""
