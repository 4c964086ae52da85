"""Producers: submitting requests in bulk and gathering their results."""
