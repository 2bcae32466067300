"""Bytes <-> records: RocketMQ's message layout, the Message types, the put path's encoder. Knows no files."""
