"""The shared leaves: modules that import nothing of the package but each other, so any layer
may use them (metrics, run folders and guards, records, named sources, routing, the cache, the
set-up errors, the heap, cli: the one error path of every command line)."""
