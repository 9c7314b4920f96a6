"""An example multiwrite backend plugin: `numpy-cpu`."""
