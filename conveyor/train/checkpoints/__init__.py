"""What a checkpoint is on disk (``conveyor.train.saving`` is its face): the manifest of
checksums and metadata, and the files of a distributed checkpoint, read without running
code.
"""

__all__: list[str] = []
