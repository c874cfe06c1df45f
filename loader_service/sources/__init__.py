"""Dataset sources: where sample bytes and labels come from.

Every source has the same small interface (:class:`~loader_service.sources.base.Source`) and
is described to worker processes by a :class:`SourceSpec`, so the plan, the workers and the
wire are the same whatever the format.
"""

from . import imagefolder, packed  # noqa: F401  (registers the source kinds)
from .base import Source, SourceSpec, open_source
from .index import PackedStrings

__all__ = ["Source", "SourceSpec", "open_source", "PackedStrings"]
