"""The mesh's third dimension: tensor parallelism inside a pipeline's stages.

A plan (the model's own, or a dict of styles) says which modules of a stage are split
over the stage's tensor group; :func:`~conveyor.tensor.apply.apply_plan` replaces their
weights by this rank's shards and puts Megatron's conjugate operators (all-reduce in
forward or backward) around them, as custom ops that ``torch.export`` keeps whole, so a
traced stage and a stage of layers run the same split modules.
"""

__all__: list[str] = []

#: The smallest tensor (bytes) that crosses a stage boundary as 1/T pieces, gathered on
#: the receiving group (:mod:`conveyor.tensor.boundary`): below it the gather's latency
#: (tens of microseconds on NVLink, hundreds on gloo) outweighs the bytes it saves.
#: Here, without torch, for the planner, which counts boundaries as the runtime sends them.
SLICED_FROM = 1 << 20
