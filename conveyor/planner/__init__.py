"""PipeDream's planner: the machines (:class:`Cluster`), the model's profile
(:func:`profile_model`), and the solver that cuts, replicates and schedules
(:func:`solve`), with a plan ``Pipeline(plan=...)`` runs; and the mesh (PP x TP x DP,
:func:`search_mesh`) with the verdict on whether to pipeline at all (:func:`decide`)."""

from conveyor.planner.machines import Cluster, Level
from conveyor.planner.profiles import LayerCost, ModelProfile, profile_model
from conveyor.planner.plans import PipelinePlan, StageChoice
from conveyor.planner.mesh import MeshCandidate, Shape, evaluate_shape
from conveyor.planner.meshsearch import search_mesh
from conveyor.planner.solver import evaluate, solve
from conveyor.planner.verdict import Verdict, decide

__all__ = ["Cluster", "LayerCost", "Level", "MeshCandidate", "ModelProfile", "PipelinePlan",
           "Shape", "StageChoice", "Verdict", "decide", "evaluate", "evaluate_shape",
           "profile_model", "search_mesh", "solve"]
