"""One module per CLI command (see ``padfree.cli``)."""
