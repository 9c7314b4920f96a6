"""The block tables of a model (`block_tables`: `BlockTables`) and their graph mode (`graph`)."""
