// Forwarding header: the frozen sm100-mxfp4 sources (generated/sm100_mxfp4/) include this path.
#pragma once
#include "k3gen/kda/verify.cuh"
