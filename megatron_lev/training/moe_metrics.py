"""The auxiliary losses of mixture-of-experts and multi-token-prediction layers, as Megatron-LM logs them.

megatron-core's MoE router saves its load-balancing and z losses per layer in its logging tracker (a dict
in ``moe_utils`` up to 0.16.1, ``moe_logging.MoEMetricsTracker`` from 0.19: see ``compat.versions``), and
the MTP block its per-layer losses in ``MTPLossLoggingHelper``'s; Megatron-LM's ``training_log`` reduces
both once per logged iteration (the MoE tracker's report, ``track_mtp_metrics``) and logs them beside the
LM loss. ``step_aux_losses``
does the same reduction (collective over the pipeline and data-parallel groups: every rank calls it) and
returns plain floats, averaged over the MoE layers and the micro-batches of the step (the MTP losses,
``mtp_<k> loss``, on the ranks of the stage that holds the MTP block).
"""

from __future__ import annotations

from typing import Any, Dict, List

from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_lev.compat.versions import report_moe_metrics, reset_moe_metrics


def aux_loss_names(config: Any) -> List[str]:
    """The tracker names of the losses ``config``'s router adds (Megatron-LM's ``training_log`` list)."""
    types = config.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = []
    for t, name in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                    ("global_aux_loss", "global_load_balancing_loss")):
        if t in types:
            names.append(name)
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def reset_aux_loss_trackers() -> None:
    """Empty megatron-core's MoE and MTP loss trackers (process globals). Their value tensors are sized
    by the first model that fills them (layers + MTP layers), so a second run in the same process with
    another depth would index past them."""
    reset_moe_metrics()
    MTPLossLoggingHelper.tracker.clear()


def step_aux_losses(config: Any, num_microbatches: int, iteration: int = 0) -> Dict[str, float]:
    """The step's MoE auxiliary losses (without their coefficients: megatron-core's router tracks the
    loss divided by ``--moe-aux-loss-coeff`` / ``--moe-z-loss-coeff``, ~1 for a balanced load) and, with MTP, ``mtp_<k> loss`` (the unscaled cross-entropy of MTP layer k); the
    trackers are cleared for the next step. Empty for a dense model without MTP."""
    out: Dict[str, float] = {}
    if getattr(config, "num_moe_experts", None):
        totals: Dict[str, Any] = {}
        report_moe_metrics(
            loss_scale=1.0 / num_microbatches, iteration=iteration, total_loss_dict=totals,
            per_layer_logging=bool(config.moe_per_layer_logging), force_initialize=True,
            track_names=aux_loss_names(config), num_layers=config.num_layers,
            moe_layer_freq=config.moe_layer_freq, mtp_num_layers=config.mtp_num_layers,
        )
        # One host copy per logged step: the values go to the log line.
        out.update({name: float(value) for name, value in totals.items()})
    if getattr(config, "mtp_num_layers", None):
        # Only the stage holding the MTP block has values; it averages them over its data-parallel group.
        totals = {}
        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / num_microbatches, iteration=iteration,
                                               writer=None, total_loss_dict=totals)
        out.update({name: float(value) for name, value in totals.items()})
    return out
