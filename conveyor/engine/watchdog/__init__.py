"""Never hang: each rank's place in its column, the timeouts of each phase, the ranks of
one process on watched threads, and the report of where every rank stood."""

__all__: list[str] = []
