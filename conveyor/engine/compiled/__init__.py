"""``compile=True`` and ``cuda_graphs=True``: a stage's layers as compiled graphs
(``stages``), their backward as an input-gradient and a weight-gradient graph
(``backward``), replayed from CUDA graphs (``cudagraphs``)."""

__all__: list[str] = []
