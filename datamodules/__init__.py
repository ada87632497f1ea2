from datamodules.mnist import MNISTDataModule

__all__ = ["MNISTDataModule"]
