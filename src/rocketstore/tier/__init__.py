"""Tiered storage: sealed segments, and the consume-queue and index files that point into them, copied to an
object store (``tieredStoreUri=s3://bucket/prefix``) and read from there once retention frees the local disk.

* :mod:`.objectstore`: the bucket, through ``pyarrow.fs`` (S3, or ``file://``);
* :mod:`.manifest`: ``tier.json``, the list of what is uploaded (the commit point);
* :mod:`.upload`: TierUploadService, the background copier;
* :mod:`.reader`: ranged reads of records, units and index entries;
* :mod:`.tiered`: the store's view: what retention may delete, where an old offset is.
"""
