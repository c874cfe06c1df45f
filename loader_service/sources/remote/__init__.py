"""Datasets in object storage: ``--data s3://bucket/prefix/``, ``gs://bucket/prefix/`` or
``https://host/path/`` (a folder with an HTML listing, one ``.tar``, or a brace pattern such as
``https://host/train-{000..009}.tar``), WebDataset shards only.

* :mod:`.store`: the URL, the listing (taken once, at start), downloads and their errors, over
  obstore (chosen by measurement: docs/benchmarks.md section 12);
* :mod:`.cache`: the shard cache on the CPU node, shared by every decode process through file
  locks, bounded by ``--cache-max-gb``;
* :mod:`.webdataset`: the source, a :class:`~loader_service.sources.webdataset.WebDatasetSource`
  whose shards are opened through the cache.
"""
