-- Argo CD health check for kvfence.dev/InferenceDeployment (install: see gitops.md).
--
-- Healthy      Ready=True, for the generation the operator last observed, and nothing rolling;
--              or Ready=False with reason ScaledToZero (replicas: 0 is what the spec asks).
-- Progressing  the operator has not observed the latest spec yet, or Progressing=True
--              (a new revision is starting, having its pools checked or being canaried, or
--              more pods of the serving revision start). Ready is a Deployment's Available:
--              True while the old revision serves a rollout, so Progressing is read first.
-- Degraded     Degraded=True, or CanaryPassed=False: the candidate revision failed its
--              isolation canary and the old revision keeps serving.
-- The message is the deciding condition's.

local hs = {}

local function condition(conditions, type)
  for _, c in ipairs(conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

local generation = obj.metadata.generation
local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfence operator to report status"
  return hs
end

-- Conditions written for an older spec say nothing about this one.
local observed = status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfence operator to observe generation " .. tostring(generation)
  return hs
end

local conditions = status.conditions
local degraded = condition(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end

local canary = condition(conditions, "CanaryPassed")
if canary ~= nil and canary.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(canary, "The isolation canary failed")
  return hs
end

local progressing = condition(conditions, "Progressing")
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(progressing, "Rolling out")
  return hs
end

local ready = condition(conditions, "Ready")
if ready ~= nil and (ready.status == "True" or ready.reason == "ScaledToZero") then
  if ready.observedGeneration == nil or generation == nil
    or ready.observedGeneration >= generation then
    hs.status = "Healthy"
    hs.message = describe(ready, "Ready")
    return hs
  end
  hs.status = "Progressing"
  hs.message = "Waiting for Ready on generation " .. tostring(generation)
  return hs
end

hs.status = "Progressing"
hs.message = describe(ready, "Waiting for Ready")
return hs
