"""What the user brings to ``conveyor train`` and the commands that take a model: the
function named on the command line (``code``), the model ``--model`` names (``model``),
and the text ``--data`` names (``corpus``)."""

__all__: list[str] = []
