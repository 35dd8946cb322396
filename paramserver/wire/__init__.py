"""The wire: the messages between trainers and servers (messages.py), what a trainer reports
(reports.py), the cache's policy (caching.py), their sizes and copies (sizing.py), and the
encodings of values (compression.py), row ids (idcodec.py), mappings of tensors (bundles.py)
and whole calls (frames.py)."""
