"""``TrainingCLI``: LightningCLI with this command line's checks and checkpoint handling."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, ClassVar

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI

from gpu_busy import options
from gpu_busy.callbacks.default_set import complete
from gpu_busy.cli.carried import leave_out_carried
from gpu_busy.cli.checkpoints import (
    checkpoint_folders,
    evaluation_dir,
    resolve_checkpoint,
    save_predictions,
    say_what_loads,
    write_into,
)
from gpu_busy.cli.error_lines import (
    cause_of,
    devices_line,
    innermost,
    raised_choosing_devices,
    raised_outside,
)
from gpu_busy.cli.keys import subcommand_in, unknown_key
from gpu_busy.cli.preflight import (
    check_master_port,
    check_slurm_launch,
    check_writable,
    resolve_precision,
)
from gpu_busy.config_files import CLASS_GROUPS, import_class
from gpu_busy.errors import UserError
from gpu_busy.faults.log_writes import guard_log_writes
from gpu_busy.log import current_rank, get_logger
from gpu_busy.options import Options
from gpu_busy.outcomes import one_line
from gpu_busy.resume import checkpoint_file
from gpu_busy.strategies import FullyShardedStrategy

log = get_logger(__name__)


class TrainingCLI(LightningCLI):
    left_out: tuple[str, ...] | list[str] = ()  # parse_arguments: settings not carried over
    # The checkpoint this run resumes, once resolved: main names it when its restore fails.
    resuming: ClassVar[Path | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = kwargs.get("args")
        given = sys.argv[1:] if given is None else given
        self._asked = given[0] if isinstance(given, list | tuple) and given else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        """Only the subcommand asked for: jsonargparse reads every signature to build each
        subcommand's parser (0.15 s apiece on a 2-core CPU, a third of the start-up). All
        four where none is named first (help, a misspelt one)."""
        every = LightningCLI.subcommands()
        return {self._asked: every[self._asked]} if self._asked in every else every

    def add_arguments_to_parser(self, parser) -> None:
        # Called once per subcommand built, in the order of subcommands(): its parser.
        self._parsers = [*getattr(self, "_parsers", []), parser]
        # The DataModule knows its classes (for an image folder, after scanning it). Applied
        # only where the model takes num_classes and the DataModule has it.
        parser.link_arguments(
            "data.num_classes", "model.init_args.num_classes", apply_on="instantiate"
        )
        # The default set's options (gpu_busy.options): `gpu_busy:` in the config,
        # --gpu_busy.monitor=... on the command line, the environment's by default.
        chosen, kinds = Options.resolved(), options.types()
        for name, f in options.fields_of():
            parser.add_argument(f"--{options.yaml_key(f)}", type=kinds[name],
                                default=getattr(chosen, name), help=f.metadata["help"])  # fmt: skip

    def instantiate_trainer(self, **kwargs: Any):
        """The Trainer with the default set added by the rule every run uses
        (``gpu_busy.callbacks.default_set.complete``): a kind the config lists stays as listed."""
        section = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer, chosen = section["trainer"], section.get("gpu_busy")
        done = complete(
            trainer.get("callbacks"), trainer.get("plugins"), settings=dict(trainer),
            **(vars(chosen) if chosen is not None else {}),
        )  # fmt: skip
        log.info("%s", done.line())  # rank zero's logger alone writes it
        return super().instantiate_trainer(**{**kwargs, **done.trainer_kwargs})

    def parse_arguments(self, parser, args) -> None:
        raw = list(sys.argv[1:] if args is None else args)
        parsers = dict(zip(self.subcommands(), getattr(self, "_parsers", []), strict=False))
        asked = subcommand_in(raw, parsers)
        error = unknown_key(parsers[asked], raw, asked) if asked is not None else None
        if error is not None:
            raise error
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else None
        lines = [leave_out_carried(g, config.get(g) if config else None, raw) for g in CLASS_GROUPS]
        self.left_out = [line for line in lines if line]  # said again under the summary
        for line in self.left_out:
            log.warning("%s", line)
        if (
            config
            and subcommand == "fit"
            and config.get("gpu_busy.resume")
            and not config.get("ckpt_path")
        ):
            config.ckpt_path = "last"  # gpu_busy.resume: what the launcher's --resume does
        # Resolved and checked before LightningCLI reads the file's hyperparameters.
        self.checkpoint = resolve_checkpoint(config, subcommand) if config else None
        if self.checkpoint is not None:
            TrainingCLI.resuming = self.checkpoint[0]
            say_what_loads(config, subcommand, *self.checkpoint)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        accelerator = str(trainer.accelerator)
        check_slurm_launch()
        accumulate = trainer.get("accumulate_grad_batches")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise UserError(
                f"trainer.accumulate_grad_batches must be 1 or more, got {accumulate!r}"
            )
        if trainer.precision is None:
            trainer.precision = resolve_precision(accelerator)
        if self.subcommand != "fit" and getattr(self, "checkpoint", None) is not None:
            out = evaluation_dir(self.checkpoint[0], self.subcommand)
            write_into(trainer.get("logger"), out)
            trainer.default_root_dir = str(out)
            # Restoring a fit's checkpoint into an evaluation: the callbacks' save folders
            # differ by design, and nothing is saved.
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
        if not trainer.get("default_root_dir"):
            # Where Lightning's SLURM requeue (SIGUSR1) saves hpc_ckpt_N.ckpt and looks for
            # it again: the run's own folder, where --ckpt_path last finds it, not the
            # working directory.
            trainer.default_root_dir = str(checkpoint_folders(trainer)[0])
        limit = trainer.get("limit_train_batches")
        if self.subcommand == "fit" and limit is not None and limit <= 0:
            raise UserError(
                f"trainer.limit_train_batches={limit:g} trains nothing; give a number of batches "
                "or a fraction of the epoch above 0"
            )
        clip = trainer.get("gradient_clip_val")
        if clip is not None and clip < 0:
            raise UserError(
                "trainer.gradient_clip_val must be 0 or more (0 or null: no clipping), "
                f"got {clip:g}"
            )

    def instantiate_classes(self) -> None:
        """The classes the config names refuse a value (an invalid strategy name, a missing
        accelerator package, a constructor's check, devices this machine lacks): one line,
        not a traceback."""
        try:
            super().instantiate_classes()
        except UserError:
            raise
        except (ValueError, TypeError, ImportError, MisconfigurationException) as e:
            if raised_choosing_devices(e):
                trainer = self.config[self.subcommand].trainer
                raise UserError(devices_line(e, trainer.accelerator, trainer.devices)) from None
            if isinstance(e, MisconfigurationException):
                raise
            own = cause_of(e, UserError) or self._constructor_error(e)
            if isinstance(own, UserError):
                raise own from None
            root = own if own is not None else innermost(e)
            raise UserError(
                "building the trainer, model or data from the config failed "
                f"({type(root).__name__}: {one_line(root)[:240]})"
            ) from e
        check_master_port(self.trainer.num_devices * self.trainer.num_nodes)

    def _constructor_error(self, error: BaseException) -> BaseException | None:
        """What a class's own constructor raised: in ``error``'s chain (jsonargparse chains
        it from 4.4x), else by building the config's data and model again here (older
        releases keep only its text)."""
        own = raised_outside(error, "jsonargparse")
        if own is not None:
            return own
        config = self.config[self.subcommand]
        for group in ("data", "model"):
            section = config.get(group)
            if not isinstance(section, Namespace) or not section.get("class_path"):
                continue
            init = section.get("init_args")
            try:
                import_class(section.class_path)(**(init.as_dict() if init else {}))
            except Exception as e:
                return e
        return None

    def _check_checkpoint_fits_model(self) -> None:
        """Shapes compared before Lightning loads the weights (a size mismatch inside fit
        is a traceback), naming the settings that differ, such as a linked class count."""
        if self.checkpoint is None:
            return
        path, checkpoint = self.checkpoint
        saved, here = checkpoint["state_dict"], self.model.state_dict()
        missing, extra = sorted(set(here) - set(saved)), sorted(set(saved) - set(here))
        if missing or extra:
            parts = []
            if missing:
                parts.append(
                    f"{len(missing)} tensor(s) of this model missing there ({missing[0]}, ...)"
                )
            if extra:
                parts.append(f"{len(extra)} there that this model lacks ({extra[0]}, ...)")
            raise UserError(
                f"{path} does not fit this model: {'; '.join(parts)}; resume it with its own "
                "model, or start a new run"
            )
        differ = checkpoint_file.shape_mismatches(saved, here)
        if not differ:
            return
        name, saved, here = differ[0]
        settings = [
            f"{key}={value!r} there, {self.model.hparams[key]!r} here"
            for key, value in (checkpoint.get("hyper_parameters") or {}).items()
            if key in self.model.hparams and self.model.hparams[key] != value
        ]
        because = f"; its settings differ: {', '.join(settings)}" if settings else ""
        raise UserError(
            f"{path} does not fit this model: {name} is {saved} there and {here} here "
            f"({len(differ)} tensor(s) differ{because}); resume it with its own model and "
            "data, or start a new run"
        )

    def before_fit(self) -> None:
        if isinstance(self.trainer.strategy, FullyShardedStrategy):
            FullyShardedStrategy.check_model(self.model)  # once, before any rank starts
        self._check_checkpoint_fits_model()
        for callback in self.trainer.callbacks:
            # RunSummary, or a summary of the user's own, says them again under the summary
            add_notes = getattr(callback, "add_run_notes", None)
            if callable(add_notes):
                add_notes(self.left_out)
        logger = self.trainer.logger
        root = Path(logger.root_dir) if logger is not None else Path(self.trainer.default_root_dir)
        check_writable(root)
        guard_log_writes(self.trainer.loggers)
        if self.checkpoint is not None and logger is not None and current_rank() == 0:
            step = int(self.checkpoint[1].get("global_step") or 0)
            checkpoint_file.keep_earlier_metrics(logger, up_to_step=step)

    before_validate = before_test = before_predict = _check_checkpoint_fits_model

    def after_predict(self) -> None:
        predictions = self.trainer.predict_loop.predictions
        if not predictions:
            return
        folder = (
            evaluation_dir(self.checkpoint[0], "predict")
            if self.checkpoint is not None
            else Path(self.trainer.default_root_dir)
        )
        world = self.trainer.world_size
        # Under DDP each rank predicts every world_size-th sample (Lightning's
        # DistributedSampler, unshuffled): rank r's file holds samples r, r + world, ...
        name = "predictions.pt" if world == 1 else f"predictions.rank{self.trainer.global_rank}.pt"
        what = save_predictions(predictions, folder / name)
        log.info("predict: %s written to %s (torch.load it)", what, folder / name)
