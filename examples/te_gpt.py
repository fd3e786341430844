"""The GPT of ``examples/gpt.py`` built from Transformer Engine layers, graphed with ``impl="transformer_engine"``.

Needs Transformer Engine (``pip install --no-build-isolation "transformer_engine[pytorch]"``). FP8 follows the
Trainer: ``--trainer.precision=transformer-engine`` (Lightning's ``TransformerEnginePrecision``, delayed scaling)
captures FP8; ``bf16-mixed`` captures bf16::

    python examples/te_gpt.py fit --config examples/gpt_small.yaml \
        --trainer.strategy=lightning_cudagraph.CUDAGraphStrategy \
        --trainer.strategy.impl=transformer_engine --trainer.strategy.scope=[layer] --trainer.precision=bf16-mixed
"""

from __future__ import annotations

import os
import sys

from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.gpt import GPTModule, TokenDataModule


class TEGPTModule(GPTModule):
    """:class:`examples.gpt.GPTModule` whose blocks are ``transformer_engine.pytorch.TransformerLayer`` s.

    Args:
        **kwargs: As for :class:`examples.gpt.GPTModule`.
    """

    def __init__(self, **kwargs: object) -> None:
        import transformer_engine.pytorch as te

        super().__init__(**kwargs)
        hp = self.hparams
        self.model.blocks = nn.ModuleList(
            te.TransformerLayer(
                hidden_size=hp.width,
                ffn_hidden_size=4 * hp.width,
                num_attention_heads=hp.heads,
                hidden_dropout=hp.dropout,
                attention_dropout=hp.dropout,
                self_attn_mask_type="causal",
                attn_input_format="bshd",
                layer_number=i + 1,
            )
            for i in range(hp.n_layer)
        )


def main() -> None:
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(TEGPTModule, TokenDataModule, seed_everything_default=0)


if __name__ == "__main__":
    main()
