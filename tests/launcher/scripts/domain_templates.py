"""Lightning's GAN and PPO examples (``../lightning_examples/``, kept as Lightning ships them)
trained a few steps on the CPU, their logged values written to a JSON file: the launcher's
tests run this plain and under ``python -m gpu_busy run`` and compare.

Their own ``main`` cannot run here as it is (the GAN asks for a GPU and 1000 epochs; PPO for
an endless loop over ``gym``), so this script builds the Trainer, as a user's script would,
around their modules: both train with manual optimisation and ``training_step(self,
batch)``, where Lightning reads the signature to leave ``batch_idx`` out.

    python domain_templates.py gan|ppo OUT.json
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent / "lightning_examples"), str(HERE / "standins")]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def main(which: str, out: str) -> None:
    pl.seed_everything(0)
    if which == "gan":
        from generative_adversarial_net import GAN

        model, images = GAN(img_shape=(1, 28, 28)), torch.rand(64, 1, 28, 28)
        loaders = [DataLoader(TensorDataset(images, torch.zeros(64)), batch_size=16)]
    else:
        from reinforce_learn_ppo import PPOLightning

        model, loaders = PPOLightning("CartPole-v0", steps_per_epoch=256, batch_size=64), []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=1,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         default_root_dir=str(Path(out).parent))  # fmt: skip
    trainer.fit(model, *loaders)
    values = {k: float(v) for k, v in trainer.callback_metrics.items()}
    Path(out).write_text(json.dumps({"values": values, "step": trainer.global_step}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
