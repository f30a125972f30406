"""Data ingestion: length files, chat/text records, tokenization, and counting lengths from data
(``padfree lengths``). Also the bundled ``seed_mix.npy`` lengths (see ``seed_mix.md``)."""
