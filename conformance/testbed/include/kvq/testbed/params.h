// The fluent parameter builders (kvq/common/params_builder.h) under the testbed's names.
#pragma once

#include "kvq/common/params_builder.h"

namespace kvq::testbed {

using params::Cache;
using params::Describe;
using params::Write;

}  // namespace kvq::testbed
