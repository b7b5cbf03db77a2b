"""Cutting a model into stages: any ``nn.Module`` traced and cut at named submodules,
or an ``nn.Sequential`` cut by a balance; choosing the cut, profiling, meta-device
weights, skip connections, and the one function that lays out a pipeline's stages.
"""

__all__: list[str] = []
