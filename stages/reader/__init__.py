"""Reader stage: O_DIRECT reads of expert records into arena slots."""
