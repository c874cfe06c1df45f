"""Example pipelines (see README "Preprocessing pipelines"): register one with
``loader-service serve --pipeline NAME=examples.pipelines.MODULE:FACTORY``."""
