"""Group all-reduce of flat float32 vectors (butterfly over HTTP). numpy only, no torch.

``Averager.routes()`` are mounted on the volunteer's peer server; ``Averager.allreduce()`` runs one round
of a signed :class:`~crowdtrain.protocol.messages.GroupAssignment`.
"""

from crowdtrain.volunteer.averaging.allreduce import Averager
from crowdtrain.volunteer.averaging.config import AveragingConfig
from crowdtrain.volunteer.averaging.exchange import RoundResult, part_bounds
from crowdtrain.volunteer.averaging.owner import ROUTE

__all__ = ["ROUTE", "Averager", "AveragingConfig", "RoundResult", "part_bounds"]
