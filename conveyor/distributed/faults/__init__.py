"""What a rank reports when another fails: bounded collectives and store calls, the
failure notice and the whereabouts of every rank, the report that names the rank that
failed, and the agreement of the ranks' options before anything runs.
"""

__all__: list[str] = []
