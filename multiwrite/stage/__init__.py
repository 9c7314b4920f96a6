"""The block-table stage of a model step beside the apply: the tables' memory (`layout`), one call's inputs and
their checks (`step`), and the generic torch gather and slot mappings (`torch_stage`)."""
