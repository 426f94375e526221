"""The pipeline's public names in one place, for the many callers that import them from here.

stages.py runs the stages (lower, compile, inspect; K3GEN_DUMP), generated.py writes the committed
generated/<target>/ trees, bundle.py the `k3gen build --out` bundles. Resolving a spec at run time
is k3gen.runtime.resolve (the pipeline never imports the runtime).
"""
from k3gen.pipeline.bundle import write_bundle
from k3gen.pipeline.generated import GENERATED_ROOT, REPO_ROOT, check_generated, generated_files, write_generated
from k3gen.pipeline.stages import Artifact, BuildResult, build_many, build_one, compile_artifact, lower, plan

__all__ = ["Artifact", "BuildResult", "GENERATED_ROOT", "REPO_ROOT", "build_many", "build_one", "check_generated",
           "compile_artifact", "generated_files", "lower", "plan", "write_bundle", "write_generated"]
