// The compiled per-call planner (kernels/planner.cpp): plain host functions on numpy
// arrays, registered into the extension's pybind11 module by register_planner.
#pragma once

#include <pybind11/pybind11.h>

namespace lrmoe {

void register_planner(pybind11::module_& m);

}  // namespace lrmoe
