"""tasks/quant/artifact.py's INT8 file loads with torch.load(weights_only=True) whatever Python wrote it: CPython 3.11.2
(Debian 12's) pickles an enum member by name through `builtins.getattr` (Lib/enum.py, Enum.__reduce_ex__), a global
the weights-only unpickler refuses; torchao's tensor subclasses carry enums, so save_model pickles them by value."""

from __future__ import annotations

import enum
import pickle

import pytest
import torch


class ByName(enum.Enum):
    """A member pickles as CPython 3.11.2 pickles every enum member."""

    A = 1
    B = 2

    def __reduce_ex__(self, proto):
        return getattr, (self.__class__, self._name_)


class Holder(torch.nn.Module):
    """A state dict carrying an enum, as a torchao tensor subclass's attributes do."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))

    def get_extra_state(self):
        return {"mapping": ByName.B}

    def set_extra_state(self, state):
        self.mapping = state["mapping"]


def test_an_int8_file_loads_weights_only_where_enums_pickle_by_name(tmp_path):
    from tasks.quant.artifact import WEIGHTS, save_model

    model = Holder()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    save_model(model, tmp_path / WEIGHTS, "torch_state_dict")
    with torch.serialization.safe_globals([ByName]):  # as torchao registers its enums
        with pytest.raises(pickle.UnpicklingError, match="GLOBAL getattr"):  # torch.save's own pickling
            torch.load(tmp_path / "plain.pt", weights_only=True)
        state = torch.load(tmp_path / WEIGHTS, weights_only=True)
    assert state["_extra_state"]["mapping"] is ByName.B and state["w"].equal(torch.ones(2))
    module = Holder()
    module.load_state_dict(state)
    assert module.mapping is ByName.B
