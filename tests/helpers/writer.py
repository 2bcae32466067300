"""A writer process for the kill tests: puts numbered messages and reports each acknowledged put on stdout."""

import sys

from rocketstore import Message, MessageStore, StoreConfig

path, flush, start, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = StoreConfig(mappedFileSizeCommitLog=64 * 1024, mappedFileSizeConsumeQueue=400, maxHashSlotNum=100,
                  maxIndexNum=400, flushDiskType=flush, flushIntervalCommitLog=20)
store = MessageStore.open(path, cfg)
out = sys.stdout
for i in range(start, start + count):
    r = store.put(Message("Kill", f"message-{i:08d}".encode() * (1 + i % 7), queue_id=i % 3, keys=f"key-{i}"))
    out.write(f"{i} {r.status.value} {r.queue_offset}\n")
    out.flush()
store.close()
