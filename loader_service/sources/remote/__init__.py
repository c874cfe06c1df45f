"""Datasets in object storage: ``--data s3://bucket/prefix/``, ``gs://bucket/prefix/`` or
``https://host/path/`` (a folder with an HTML listing, one ``.tar``, or a brace pattern such as
``https://host/train-{000..009}.tar``): WebDataset shards, or (s3://, gs://) an ImageFolder of loose
objects, ``<prefix>/<class>/<image>`` (:func:`~loader_service.sources.detect.open_url` picks).

* :mod:`.store`: the URL, the listing (taken once, at start), downloads and their errors, over
  obstore (chosen by measurement: docs/benchmarks.md section 12);
* :mod:`.cache`: the shard cache on the CPU node, shared by every decode process through file
  locks, bounded by ``--cache-max-gb``;
* :mod:`.webdataset`: the shards' source, a :class:`~loader_service.sources.webdataset.WebDatasetSource`
  whose shards are opened through the cache, indexed at a first start from ``wds-index.json``
  beside them when there is one;
* :mod:`.imagefolder`: loose images, the listing their index, cached in units of the shard cache
  when the cap holds them all (else each read one checked GET: its docstring says why);
* :mod:`.packed`: a packed dataset (``meta.json`` under the prefix), its index files downloaded
  once, each sample one ranged GET of ``data.bin``.
"""
