# frozen_string_literal: true

require_relative '../../../puppet_x/vmhost/provider'
require_relative '../../../puppet_x/vmhost/spec'

Puppet::Type.type(:vmhost_vm).provide(:vmhostd) do
  desc <<~DOC
    Talks to vmhostd over its Unix socket (JSON-RPC 2.0, Ruby standard library only).
    Current state comes from one `vm.list` per socket (prefetch). Changes are collected and
    applied once, in `flush`: `vm.apply` with the full spec (the daemon creates, starts,
    stops, changes the VM in place keeping its disk, replaces it for a new boot image with
    `replace => true`, or changes guest interfaces and SSH access live, as its own rules
    say), or `vm.destroy` for `ensure => absent`. Nothing is sent in noop mode.
  DOC

  # client, instances, prefetch (one vm.list per socket), socket, send_call, puppet_error.
  include PuppetX::Vmhost::Provider

  class << self
    def list_method
      'vm.list'
    end

    # The provider's view of a VM from vmhostd's VM view.
    def hash_from_view(view, socket)
      spec = view['spec'].is_a?(Hash) ? view['spec'] : {}
      hash = {
        name: view['name'],
        ensure: PuppetX::Vmhost::Spec::RUNNING_STATUSES.include?(view['status']) ? :running : :stopped,
        status: view['status'],
        spec: spec,
        socket: socket
      }
      PuppetX::Vmhost::Spec::ATTRIBUTES.each_key do |attr|
        hash[attr] = PuppetX::Vmhost::Spec.attribute_value(spec, attr)
      end
      hash
    end
  end

  def initialize(value = {})
    super
    @pending = {}
  end

  # The current state, fetched with vm.get when prefetch did not provide it.
  def current
    return @property_hash unless @property_hash.empty?

    view = begin
      self.class.client(socket).call('vm.get', { 'name' => resource[:name] })
    rescue PuppetX::Vmhost::DaemonError => e
      raise puppet_error(e) unless e.code == 4040

      nil
    rescue PuppetX::Vmhost::Error => e
      raise puppet_error(e)
    end
    @property_hash = view ? self.class.hash_from_view(view, socket) : { name: resource[:name], ensure: :absent }
  end

  def current_ensure
    current[:ensure] || :absent
  end

  def exists?
    current_ensure != :absent
  end

  def request_ensure(value)
    @pending[:ensure] = value
  end

  def create
    request_ensure(:present)
  end

  def destroy
    request_ensure(:absent)
  end

  PuppetX::Vmhost::Spec::ATTRIBUTES.each_key do |attr|
    define_method(attr) { current[attr] }
    define_method(:"#{attr}=") { |_value| @pending[attr] = true }
  end

  # Sends the collected changes: one vm.destroy or one vm.apply. Puppet does not call flush in
  # noop mode; the guard below keeps it that way if a caller does.
  def flush
    return if @pending.empty? || resource.noop?

    if @pending[:ensure] == :absent
      call('vm.destroy', { 'name' => resource[:name] })
      @property_hash = { name: resource[:name], ensure: :absent }
    else
      before = exists? ? current[:spec] : nil
      result = call('vm.apply', apply_params)
      view = result.is_a?(Hash) ? result['vm'] : nil
      @property_hash = view.is_a?(Hash) ? self.class.hash_from_view(view, socket) : {}
      warn_unchanged(result)
      report_change(before, view) if before && view.is_a?(Hash)
    end
    @pending = {}
  end

  # The full spec: the recorded one with every declared attribute over it (declared values
  # are sent even when only another one changed, so one call converges everything).
  def desired_spec
    exists = current_ensure != :absent
    declared = {}
    PuppetX::Vmhost::Spec::ATTRIBUTES.each_key do |attr|
      prop = resource.property(attr)
      declared[attr] = prop.should if prop && !prop.should.nil?
    end
    PuppetX::Vmhost::Spec.build(resource[:name], exists ? current[:spec] : nil, declared, desired_state(exists))
  end

  # vm.apply's params: the full spec, replace only when declared, and how a running VM
  # restarts for an in-place change.
  def apply_params
    { 'spec' => desired_spec, 'replace' => resource[:replace] == true,
      'restart' => resource[:restart] != false, 'timeout_s' => restart_timeout }
  end

  private

  def restart_timeout
    resource[:restart_timeout] || 30
  end

  # Says what vmhostd did to an existing VM whose spec changed: a new boot image is a replace
  # (new disk), anything else was changed in place with the disk kept.
  def report_change(before, view)
    fields = PuppetX::Vmhost::Spec.drift(before, view['spec'])
    return if fields.empty?

    if fields.include?('boot.image')
      resource.notice("replaced with a new disk (#{fields.join(', ')}); the old disk overlay was deleted")
    elsif view['pending_restart'] == true
      resource.notice("reconfigured in place, disk kept (#{fields.join(', ')}); " \
                      'restart => false: the change applies at the next start of the VM')
    else
      resource.notice("reconfigured in place, disk kept (#{fields.join(', ')})")
    end
  end

  # running / stopped as declared; for present the observed run state is kept (a new VM
  # gets the daemon's default, running).
  def desired_state(exists)
    want = resource.should(:ensure) || :present
    return want.to_s if %i[running stopped].include?(want)
    return nil unless exists

    current_ensure == :running ? 'running' : 'stopped'
  end

  # Puppet saw a difference but vmhostd changed nothing: a declared value is written
  # differently from the way the daemon records it, and every run would report a change.
  def warn_unchanged(result)
    return unless result.is_a?(Hash) && result['changed'] == false

    Puppet.warning("vmhost_vm[#{resource[:name]}]: vmhostd reported no change for vm.apply; " \
                   'a declared value probably differs from the recorded spec only in how it is written')
  end

  def call(method, params)
    timeout = resource[:timeout] || PuppetX::Vmhost::Client::MUTATING_TIMEOUT
    # A restart for an in-place change waits for the guest's power-off first.
    timeout += restart_timeout if method == 'vm.apply'
    send_call(method, params, timeout)
  end

  # What puppet_error adds to a refusal: the attribute of the offending field, and for a new
  # boot image without replace, how to allow it.
  def refusal_detail(err)
    text = +''
    attr = PuppetX::Vmhost::Spec.attribute_for_field(err.field)
    text << " (attribute #{attr})" if attr
    if err.code == 2002 && resource[:replace] != true
      text << '; a new boot image needs a new disk: set replace => true to let vmhostd recreate ' \
              'the VM (this deletes its disk overlay)'
    end
    text
  end
end
