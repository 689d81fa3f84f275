"""SecAgg+ secure aggregation (Bell et al. 2020, on Bonawitz et al. 2017), transport-agnostic.

Every message is ``bytes``; a round is the fixed stages :data:`STAGES`. A transport sends each live client
``ServerSession.requests(stage)[cid]``, hands the reply to ``ServerSession.accept`` and, when the stage's deadline
passes, calls ``close_stage`` (the silent clients are dropouts). ``run_round_inprocess`` does this in one process.

What it guarantees: the server learns only the weighted sum of the survivors' quantised updates, their total
weight and the total count of clipped coordinates; each masked vector it receives is uniform mod ``2**bits``
whatever the update (one fresh self mask from a 256-bit seed, AES-256-CTR). Up to ``s - t`` of any client's
``s`` neighbours may drop at any stage. Every client-server message is tagged (GMAC under a per-round X25519
key) and bound to its round, stage and parties; shares are AES-GCM ciphertexts the server only routes.
Threat model: an honest-but-curious server and clients (Bonawitz et al. 2017's semi-honest setting) over an
authenticated transport (mutual TLS). It does not run the paper's consistency-check round with signatures, so a
server that actively lies to different clients about who dropped is out of scope, as are clients that send
malformed words on purpose (those are caught only as ``overflowed`` coordinates, or as wrong shares when extra
shares disagree).
"""

from __future__ import annotations

from crosstrain.plugins.fl.secagg.client import ClientSession
from crosstrain.plugins.fl.secagg.errors import ProtocolError, SecAggAbort
from crosstrain.plugins.fl.secagg.inprocess import run_round_inprocess
from crosstrain.plugins.fl.secagg.params import SecAggParams
from crosstrain.plugins.fl.secagg.quantise import plain_aggregate
from crosstrain.plugins.fl.secagg.server import AggregateResult, ServerSession
from crosstrain.plugins.fl.secagg.wire import STAGES

__all__ = [
    "STAGES",
    "AggregateResult",
    "ClientSession",
    "ProtocolError",
    "SecAggAbort",
    "SecAggParams",
    "ServerSession",
    "plain_aggregate",
    "run_round_inprocess",
]
