"""The store's background threads (flush, dispatch, clean, metrics, warm-ahead), each given the parts it needs."""
