"""The writer of the power-loss test: SYNC_FLUSH puts until killed, each acknowledged put recorded durably.

Usage: powerloss_writer.py STORE SHADOW ACKS SEED.  The store's syncs are shadowed
(helpers/powerloss.py); each PUT_OK is appended to ACKS as a JSON line and fsynced
before the next put, so the parent knows every message the store acknowledged.
"""

import json
import os
import random
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.powerloss import SyncShadow, quiet_mode, writer_config  # noqa: E402
from rocketstore import Message, MessageStore, PutMessageStatus  # noqa: E402


def main() -> None:
    store_dir, shadow, acks, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rng = random.Random(seed)
    os.makedirs(store_dir, exist_ok=True)
    SyncShadow(store_dir, shadow).install()
    store = MessageStore.open(store_dir, writer_config(seed))
    fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    i = 0
    while True:
        topic = rng.choice(["PowerA", "PowerB"])
        qid = rng.randrange(3)
        if quiet_mode() and rng.random() < 0.02:
            topic, qid = "PowerQuiet", 0  # a queue that gets a message now and then
        n = rng.randint(2, 4) if rng.random() < 0.2 else 1  # some puts are batches (one record run, one sync)
        msgs = []
        for j in range(n):
            body = rng.randbytes(rng.choice([rng.randint(1, 200), rng.randint(200, 3000)]))
            msgs.append(Message(topic, body, queue_id=qid, tags=rng.choice(["TagA", "TagB", None]),
                                keys=f"pl-{seed}-{i + j}"))
        r = store.put(msgs[0]) if n == 1 else store.put_batch(msgs)
        if r.status is PutMessageStatus.PUT_OK:
            lines = [{"topic": topic, "queueId": qid, "queueOffset": r.queue_offset + j, "key": m.keys,
                      "commitLogOffset": r.commit_log_offset if n == 1 else None, "batch": n,
                      "bodyCrc": zlib.crc32(m.body)} for j, m in enumerate(msgs)]
            os.write(fd, "".join(json.dumps(line) + "\n" for line in lines).encode())
            os.fsync(fd)  # outside the store root: a real fsync, not shadowed
        i += n

if __name__ == "__main__":
    main()
