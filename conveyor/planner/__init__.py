"""PipeDream's planner: the machines (:class:`Cluster`), the model's profile
(:func:`profile_model`), and the solver that cuts, replicates and schedules
(:func:`solve`), with a plan ``Pipeline(plan=...)`` runs."""

from conveyor.planner.machines import Cluster, Level
from conveyor.planner.profiles import LayerCost, ModelProfile, profile_model
from conveyor.planner.plans import PipelinePlan, StageChoice
from conveyor.planner.solver import evaluate, solve

__all__ = ["Cluster", "LayerCost", "Level", "ModelProfile", "PipelinePlan", "StageChoice",
           "evaluate", "profile_model", "solve"]
