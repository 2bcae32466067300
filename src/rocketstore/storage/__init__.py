"""The store's file kinds (commitlog, consume queues, index, checkpoint, lock, offsets) and checks over them."""
