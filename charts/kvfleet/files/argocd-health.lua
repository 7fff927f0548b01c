-- Argo CD health of a kvfleet InferenceService.
-- Install as resource.customizations.health.kvfleet.dev_InferenceService in argocd-cm.
--   Healthy      Ready is True and the operator has seen the current generation
--   Progressing  the operator has not caught up yet, or replicas are rolling out or starting
--   Degraded     Ready is False for a reason that needs a person or the cluster to change
--   Suspended    scaled to zero on purpose (spec.scaling.replicas: 0)
local failures = {
  InvalidSpec = true,
  InvalidModelURI = true,
  ReconcileFailed = true,
  ProgressDeadlineExceeded = true,
  InsufficientGPU = true,
  Unschedulable = true,
  ReplicaFailing = true,
  PodCreationFailed = true,
  SafetyLoosened = true,
}

local health = {}
local generation = obj.metadata.generation or 0

if obj.status == nil or obj.status.observedGeneration == nil then
  health.status = "Progressing"
  health.message = "Waiting for the kvfleet operator to report"
  return health
end

if obj.status.observedGeneration < generation then
  health.status = "Progressing"
  health.message = "Waiting for the kvfleet operator to observe generation " .. generation
  return health
end

local ready = nil
if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    if condition.type == "Ready" then
      ready = condition
    end
  end
end

if ready == nil or (ready.observedGeneration ~= nil and ready.observedGeneration < generation) then
  health.status = "Progressing"
  health.message = "Waiting for the Ready condition of generation " .. generation
  return health
end

health.message = ready.message or ""
if ready.status == "True" then
  health.status = "Healthy"
elseif ready.reason == "ScaledToZero" then
  health.status = "Suspended"
elseif failures[ready.reason] then
  health.status = "Degraded"
else
  health.status = "Progressing"
end
return health
