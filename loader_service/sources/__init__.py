"""Dataset sources: where sample bytes and labels come from.

Every source has the same small interface (:class:`~loader_service.sources.base.Source`) and
is described to worker processes by a :class:`SourceSpec`, so the plan, the workers and the
wire are the same whatever the format.
"""

from loader_service.sources import hdf5, imagefolder, packed, webdataset  # noqa: F401  (registers the source kinds)
from loader_service.sources.base import Source, SourceSpec, open_source
from loader_service.sources.detect import detect_kind, open_path
from loader_service.sources.index import PackedStrings

__all__ = ["Source", "SourceSpec", "open_source", "open_path", "detect_kind", "PackedStrings"]
