"""What both offload strategies do at Lightning's hooks: hand them to their :class:`EmbeddingOffload`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from torch.optim import Optimizer
from typing_extensions import override

from lightning_dynamix._forwarding import Forwarded
from lightning_dynamix.strategies.layer_offload.embedding_offload import OFFLOAD_ARGUMENTS, EmbeddingOffload


class EmbeddingOffloadHooks(ABC):
    """A mixin, before a DDP strategy in the bases: every hook that must reach the servers handed to the strategy's
    :class:`EmbeddingOffload` (``embedding_offload``), whose arguments, ``plan`` and ``client`` are the strategy's
    attributes too (``strategy.staleness`` is ``strategy.embedding_offload.staleness``; setting one sets the other).

    The strategy sets ``embedding_offload`` in its constructor, takes the tables at set-up, and says with what weight
    the servers sum the trainers' row gradients (:meth:`_row_gradient_weight`).
    """

    embedding_offload: EmbeddingOffload

    @abstractmethod
    def _row_gradient_weight(self) -> float:
        """The factor the servers multiply each trainer's row gradients by, as the all-reduce does the dense ones."""

    # training ------------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        closure = self.embedding_offload.before_optimizer_step(optimizer, closure)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.embedding_offload.after_optimizer_step(row_gradient_weight=self._row_gradient_weight())
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.embedding_offload.read_ahead(super().process_dataloader(dataloader))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs, training=True)
        return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.embedding_offload.prefetch_for_step(args, kwargs)
        return super().predict_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.embedding_offload.flush()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self.embedding_offload.flush()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.embedding_offload.flush()

    # checkpoints -----------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.embedding_offload.save_shards(checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        self.embedding_offload.remove_shards(filepath)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the servers must exist to take their shards back

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self.embedding_offload.remember_checkpoint(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self.embedding_offload.load_shards(checkpoint)

    # the end ---------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.embedding_offload.note_failure()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.embedding_offload.teardown()
        super().teardown()


for _name in (*OFFLOAD_ARGUMENTS, "plan", "client"):
    setattr(EmbeddingOffloadHooks, _name, Forwarded("embedding_offload", settable=True))
    getattr(EmbeddingOffloadHooks, _name).__set_name__(EmbeddingOffloadHooks, _name)
