"""Start-up recovery after clean and unclean shutdown, verify, and repair."""
