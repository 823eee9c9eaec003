"""Models that ship with jagg-autograd (pretrained weights under ``jagg_autograd/assets``)."""

from jagg_autograd.models.digits import (
    NULL_LABEL,
    NUM_CLASSES,
    DigitsClassifier,
    DigitsClassifierConfig,
    DigitsDiT,
    DigitsDiTConfig,
    build_digits_classifier,
    build_digits_dit,
    digit_reward,
    digits_dataset,
    digits_split,
    load_digits_classifier,
    load_digits_dit,
    load_digits_meta,
    sample_digits,
)

__all__ = [
    "NULL_LABEL",
    "NUM_CLASSES",
    "DigitsClassifier",
    "DigitsClassifierConfig",
    "DigitsDiT",
    "DigitsDiTConfig",
    "build_digits_classifier",
    "build_digits_dit",
    "digit_reward",
    "digits_dataset",
    "digits_split",
    "load_digits_classifier",
    "load_digits_dit",
    "load_digits_meta",
    "sample_digits",
]
