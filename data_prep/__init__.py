"""Corpus → tokenizer → packed sequences → WebDataset shard set, and the training loader that reads it.

Kept import-light (no torch, no mlflow): the data DAG's mapped tasks import it. Use the modules:
`data_prep.build.build_shard_set`, `data_prep.loader.ShardLoader`, `data_prep.manifest.load_manifest`,
`data_prep.testing.tiny_shard_set`. This package never imports `tasks`.
"""
