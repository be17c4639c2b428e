"""Retrieval engines: sentence-transformers embedders, rerankers, the LanceDB vector store, and the
vectors handed between them."""
