"""The block-table stage of a model step beside the apply: the tables' memory (`layout`), one call's inputs and
their checks (`step`), and the generic torch gather and slot mappings (`torch_stage`)."""

from multiwrite._deprecated import moved_names

#: 0.2.0's `multiwrite/stage.py` held these names (deprecated here, removed in 0.4.0).
__getattr__ = moved_names("multiwrite.stage", globals(), {"PAD_SLOT_ID": "multiwrite.stage.layout",
                                               "StageInputError": "multiwrite.errors"})  # fmt: skip
