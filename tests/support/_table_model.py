"""The dynamic HashTable's contract (docs/api.md 2 and 3a) in plain Python, the
reference of tests/tables/test_hashtable_eviction.py and tests/peers/test_peer_hkv.py: rows in order of
arrival, freed rows reused in ascending order, LRU / LFU eviction with ties broken by the
smaller key, the keys of the call never evicted, a call larger than the capacity (or past
a full table without eviction) changing nothing, last_seen / count scores under a clock
the caller advances."""

from sparsekit.hashtable import HashTableFullError


class TableModel:
    """The contract in plain Python."""

    def __init__(self, capacity, eviction=None):
        self.capacity, self.eviction = capacity, eviction
        self.keys, self.last_seen, self.count = [], [], []  # by row
        self.rows = {}  # key -> row
        self.clock = 0

    def __len__(self):
        return len(self.keys)

    @staticmethod
    def _occurrences(keys):
        occurrences = {}
        for key in keys:
            occurrences[key] = occurrences.get(key, 0) + 1
        return occurrences

    def insert(self, keys):
        """(rows, [(evicted_key, evicted_row), ...]) or HashTableFullError (nothing changed)."""
        occurrences = self._occurrences(keys)
        new = [key for key in occurrences if key not in self.rows]
        if len(occurrences) > self.capacity or (self.eviction is None and len(self.rows) + len(new) > self.capacity):
            raise HashTableFullError("model: full")
        num_evict = max(0, len(new) - (self.capacity - len(self.keys)))
        candidates = [row for row, key in enumerate(self.keys) if key not in occurrences]
        if self.eviction == "lru":
            candidates.sort(key=lambda row: (self.last_seen[row], self.keys[row]))
        else:
            candidates.sort(key=lambda row: (self.count[row], self.last_seen[row], self.keys[row]))
        victims = sorted(candidates[:num_evict])
        evicted = [(self.keys[row], row) for row in victims]
        for key, _ in evicted:
            del self.rows[key]
        free = victims + list(range(len(self.keys), len(self.keys) + len(new) - num_evict))
        for key, row in zip(new, free):
            if row == len(self.keys):
                self.keys.append(key)
                self.last_seen.append(0)
                self.count.append(0)
            self.keys[row], self.count[row] = key, 0
            self.rows[key] = row
        self.score(occurrences)
        return [self.rows[key] for key in keys], evicted

    def touch(self, keys):
        occurrences = self._occurrences(keys)
        self.score({key: n for key, n in occurrences.items() if key in self.rows})
        return [self.rows.get(key, -1) for key in keys]

    def find(self, keys):
        return [self.rows.get(key, -1) for key in keys]

    def score(self, occurrences):
        for key, n in occurrences.items():
            row = self.rows[key]
            self.last_seen[row] = self.clock
            self.count[row] += n

    def clear(self):
        self.rows, self.keys, self.last_seen, self.count = {}, [], [], []

    def export(self, min_last_seen=None):
        rows = [row for row in range(len(self)) if min_last_seen is None or self.last_seen[row] >= min_last_seen]
        return [self.keys[row] for row in rows], rows
