"""Batched tasks: user batch functions, the helpers they use, built-in adapters.

``carpool.batched.padding`` pads token lists for a batch function; ``carpool.batched.adapters`` holds
ready-made batch functions (embedding, reranker, classifier). Nothing here imports torch at import.
"""
