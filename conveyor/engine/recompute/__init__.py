"""What makes a forward run again for backward compute what it computed the first time:
the replay itself on torch.utils.checkpoint (``replay``), each layer call's random stream
(``rng``), and the module state a forward changes (``sideeffects``).
"""

__all__: list[str] = []
