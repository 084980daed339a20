"""The hybrid radix tree and the caches built on it: nodes, match, lock/unlock, split, compress, insert,
byte accounting, the eviction walk, and the candidate indexes that keep eviction scores current."""
